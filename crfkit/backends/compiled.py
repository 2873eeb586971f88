"""The compiled (C++ / CUDA) backend: loads crfkit._C and registers, for each op,
a fake (meta) implementation so that torch.compile can trace it. The autograd formulas are
registered in C++ (csrc/autograd.cpp), except those of the marginals and of the expected
transition counts (below). The ops, their schemas and fakes are listed once, in
crfkit/backends/op_table.py.

The backward of every op is itself a registered op (log_partition_backward_from_marginals on
the CPU and CUDA, log_partition_backward on a device without log_partition_with_marginals,
sequence_score_backward, marginals_backward, expected_transition_counts_backward on the CPU), as
PyTorch recommends for custom kernels. Importing this module raises ImportError when the
extension is not built; crfkit.backends then falls back.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _C  # noqa: F401  (loading the library registers torch.ops.crfkit.*)
from .. import reference
from . import deferred_errors, op_table

ops = torch.ops.crfkit

# Refuse an extension built from older sources (an editable install not rebuilt after a schema
# change), which would otherwise be called with its arguments in another order.
op_table.check_schemas()
op_table.register_fakes()
deferred_errors.add_library(_C.__file__)  # the CUDA kernels' error mode (no-op without CUDA)


# ---- autograd ---------------------------------------------------------------------------------
# The formulas of log_partition, viterbi, kbest_viterbi and sequence_score
# are registered in C++ (csrc/autograd.cpp), so that a call does not pass through Python's
# autograd wrapper. The formulas of the marginals and of the expected transition counts stay
# here: each picks its analytic kernel where the device has one, else differentiates the reference.
def _save_crf_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])


def _second_derivative(kernel_name: str, reference_op):
    """The autograd formula of an op that is a first derivative of log Z (the marginals, in the
    emissions; the expected transition counts, in the transitions): its vector-Jacobian product
    is a Hessian-vector product of log Z. Where the device has the analytic kernel kernel_name
    (csrc/cpu/marginals_backward.cpp, csrc/cuda/marginals_backward.cu: the tangent of the
    forward-backward in the direction of the upstream gradient, one pass, in double) it is that
    kernel, whose result cannot be differentiated again (a third derivative of log Z raises);
    elsewhere autograd over the reference's op (reference.gradients_by_autograd)."""
    def backward(ctx, grad):
        emissions, transitions, lengths, start, end = ctx.saved_tensors
        if _has_kernel(kernel_name, emissions):
            g = getattr(ops, kernel_name)(grad, emissions, transitions, lengths, start, end)
            return g[0], g[1], None, g[2], g[3]
        return reference.gradients_by_autograd(reference_op, ctx.saved_tensors, grad)
    return backward


# Both backward ops have CPU and CUDA kernels (a build without CUDA takes the reference there).
_marginals_backward = _second_derivative("marginals_backward", reference.marginals)
_expected_transition_counts_backward = _second_derivative("expected_transition_counts_backward",
                                                          reference.expected_transition_counts)
torch.library.register_autograd("crfkit::marginals", _marginals_backward, setup_context=_save_crf_inputs)
torch.library.register_autograd("crfkit::expected_transition_counts", _expected_transition_counts_backward,
                                setup_context=_save_crf_inputs)


# ---- the backend interface: crfkit.backends.CRFBackend ------------------------------------------
# (same order of arguments as crfkit.reference). Every op of the contract has its own kernels
# here; where one has no kernel for a device or for a differentiable call, the function says
# which fallback it takes.
def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


# Which (op, device) pairs have a kernel (a build without CUDA kernels has none on CUDA; the
# emulator's tests swap in its own table). Looked up once here: torch.compile cannot trace the
# dispatcher query itself.
_KERNELS = {(name, key): torch._C._dispatch_has_kernel_for_dispatch_key(f"crfkit::{name}", key)
            for name in op_table.OPS for key in ("CPU", "CUDA")}


# The device types whose kernels check the values of lengths and tags themselves (on the device,
# raising once they have run, with the argument and index named: csrc/cuda/common.cu): CUDA,
# where the kernels are built. The front end (crfkit._arguments) leaves those checks to them
# there, as its own would read the values back to the host, a reduction and copies that wait
# for the device, on every call. Not the CPU: its kernels check them too, but the front end's
# check costs about 1 us there and its message gives the whole range. (The emulator's tests put
# "cpu" here, to run the CUDA path on its CPU tensors.)
VALUES_CHECKED_ON_DEVICE = ("cuda",) if _KERNELS[("log_partition", "CUDA")] else ()


def _has_kernel(op_name: str, tensor: Tensor) -> bool:
    """Whether op_name has a kernel for tensor's device."""
    return _KERNELS[(op_name, "CUDA" if tensor.is_cuda else "CPU")]


def log_partition(emissions: Tensor, transitions: Tensor, lengths: Tensor, start: Tensor, end: Tensor) -> Tensor:
    # Without gradient: O(T) working memory per thread. A differentiable call on the CPU also
    # computes the marginals for its backward (csrc/autograd.cpp, LogPartition).
    return ops.log_partition(emissions, transitions, lengths, start, end)


def expected_transition_counts(emissions, transitions, lengths, start, end) -> Tensor:
    if not _has_kernel("expected_transition_counts", emissions):
        if lengths.device.type in VALUES_CHECKED_ON_DEVICE:  # no kernel checks them in this call
            # Imported here, not at the top: crfkit._arguments asks crfkit.backends which backend
            # is current, and this module is imported while crfkit.backends is being set up.
            from .._arguments import check_length_values

            check_length_values(lengths, emissions.shape[1])
        return reference.expected_transition_counts(emissions, transitions, lengths, start, end)
    return ops.expected_transition_counts(emissions, transitions, lengths, start, end)


def marginals(emissions, transitions, lengths, start, end) -> Tensor:
    return ops.marginals(emissions, transitions, lengths, start, end)


def marginals_and_transition_counts(emissions, transitions, lengths, start, end):
    # Both from one forward-backward where a kernel gives both (CPU, no gradient): the exact
    # entropy, cross entropy and KL of crfkit.distribution need both, and each alone costs a
    # whole forward-backward.
    if _needs_grad(emissions, transitions, start, end) or not _has_kernel("log_partition_with_marginals", emissions):
        return (marginals(emissions, transitions, lengths, start, end),
                expected_transition_counts(emissions, transitions, lengths, start, end))
    _, mu, counts = ops.log_partition_with_marginals(emissions, transitions, lengths, start, end)
    return mu, counts


def viterbi(emissions, transitions, lengths, start, end):
    return ops.viterbi(emissions, transitions, lengths, start, end)


def kbest_viterbi(emissions, transitions, k, lengths, start, end):
    # Without gradient, one op gives the lists and log Z (the CPU runs both kernels side by side
    # when the batch is smaller than the threads); differentiable calls take the two
    # differentiable ops.
    if not _needs_grad(emissions, transitions, start, end) and _has_kernel("kbest_viterbi_with_log_probs", emissions):
        return ops.kbest_viterbi_with_log_probs(emissions, transitions, k, lengths, start, end)
    scores, paths = ops.kbest_viterbi(emissions, transitions, k, lengths, start, end)
    log_z = ops.log_partition(emissions, transitions, lengths, start, end)
    return scores, paths, reference.log_probs_from_scores(scores, log_z)


def sequence_score(emissions, transitions, tags, lengths, start, end) -> Tensor:
    return ops.sequence_score(emissions, transitions, tags, lengths, start, end)
