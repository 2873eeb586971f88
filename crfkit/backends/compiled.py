"""The compiled (C++ / CUDA) backend: loads crfkit._C and registers, for each op,
a fake (meta) implementation so that torch.compile can trace it. The autograd formulas are
registered in C++ (csrc/autograd.cpp), except the marginals' (below).

The backward of every op is itself a registered op (log_partition_backward_from_marginals on
the CPU and CUDA, log_partition_backward on a device without log_partition_with_marginals,
sequence_score_backward, marginals_backward on the CPU), as PyTorch recommends for custom
kernels. Importing this module raises ImportError when the extension is not built;
crfkit.backends then falls back.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _C  # noqa: F401  (loading the library registers torch.ops.crfkit.*)
from .. import reference

ops = torch.ops.crfkit

# The Python side below relies on these schemas (argument and output order). An extension built
# from older sources (an editable install not rebuilt after a schema change) would otherwise
# return, say, (paths, scores) where (scores, paths) is expected: refuse to load it instead.
EXPECTED_SCHEMAS = {
    "log_partition": ("crfkit::log_partition(Tensor emissions, Tensor transitions, Tensor start, Tensor end, "
                      "Tensor lengths) -> Tensor"),
    "marginals": ("crfkit::marginals(Tensor emissions, Tensor transitions, Tensor start, Tensor end, "
                  "Tensor lengths) -> Tensor"),
    "marginals_backward": ("crfkit::marginals_backward(Tensor grad_marginals, Tensor emissions, Tensor transitions, "
                           "Tensor lengths, Tensor start, Tensor end) -> (Tensor, Tensor, Tensor, Tensor)"),
    "log_partition_backward": ("crfkit::log_partition_backward(Tensor grad_log_z, Tensor emissions, "
                               "Tensor transitions, Tensor start, Tensor end, Tensor lengths) "
                               "-> (Tensor, Tensor, Tensor, Tensor)"),
    "log_partition_with_marginals": ("crfkit::log_partition_with_marginals(Tensor emissions, Tensor transitions, "
                                     "Tensor start, Tensor end, Tensor lengths) "
                                     "-> (Tensor log_z, Tensor marginals, Tensor transition_counts)"),
    "log_partition_backward_from_marginals": ("crfkit::log_partition_backward_from_marginals(Tensor grad_log_z, "
                                              "Tensor marginals, Tensor transition_counts, Tensor lengths) "
                                              "-> (Tensor, Tensor, Tensor, Tensor)"),
    "expected_transition_counts": ("crfkit::expected_transition_counts(Tensor emissions, Tensor transitions, "
                                   "Tensor start, Tensor end, Tensor lengths) -> Tensor"),
    "viterbi": ("crfkit::viterbi(Tensor emissions, Tensor transitions, Tensor start, Tensor end, "
                "Tensor lengths) -> (Tensor scores, Tensor paths)"),
    "kbest_viterbi": ("crfkit::kbest_viterbi(Tensor emissions, Tensor transitions, Tensor start, Tensor end, "
                      "Tensor lengths, int k) -> (Tensor scores, Tensor paths)"),
    "kbest_viterbi_with_log_probs": ("crfkit::kbest_viterbi_with_log_probs(Tensor emissions, Tensor transitions, "
                                     "Tensor start, Tensor end, Tensor lengths, int k) "
                                     "-> (Tensor scores, Tensor paths, Tensor log_probs)"),
    "sequence_score": ("crfkit::sequence_score(Tensor emissions, Tensor transitions, Tensor start, Tensor end, "
                       "Tensor lengths, Tensor tags) -> Tensor"),
    "sequence_score_backward": ("crfkit::sequence_score_backward(Tensor grad_scores, Tensor emissions, Tensor lengths, "
                                "Tensor tags) -> (Tensor, Tensor, Tensor, Tensor)"),
}


def check_schemas(expected=EXPECTED_SCHEMAS) -> None:
    """Raise ImportError unless every op is registered with the schema this module expects."""
    for name, schema in expected.items():
        found = str(getattr(ops, name).default._schema) if hasattr(ops, name) else "missing"
        if found != schema:
            raise ImportError(
                f"crfkit._C is out of date: op {name} has schema {found!r}, expected {schema!r}; "
                "rebuild it with `pip install --no-build-isolation -e .`"
            )


check_schemas()


# ---- fake implementations: shapes and dtypes only ------------------------------------------
@torch.library.register_fake("crfkit::log_partition")
def _(emissions, transitions, start, end, lengths):
    return emissions.new_empty(emissions.shape[0])


@torch.library.register_fake("crfkit::marginals")
def _(emissions, transitions, start, end, lengths):
    return torch.empty_like(emissions)


@torch.library.register_fake("crfkit::marginals_backward")
def _(grad_marginals, emissions, transitions, lengths, start, end):
    return torch.empty_like(emissions), torch.empty_like(transitions), torch.empty_like(start), torch.empty_like(end)


@torch.library.register_fake("crfkit::log_partition_backward")
def _(grad_log_z, emissions, transitions, start, end, lengths):
    return torch.empty_like(emissions), torch.empty_like(transitions), torch.empty_like(start), torch.empty_like(end)


@torch.library.register_fake("crfkit::log_partition_with_marginals")
def _(emissions, transitions, start, end, lengths):
    B, _L, T = emissions.shape
    return emissions.new_empty(B), torch.empty_like(emissions), emissions.new_empty((B, T, T))


@torch.library.register_fake("crfkit::log_partition_backward_from_marginals")
def _(grad_log_z, marginals, transition_counts, lengths):
    T = marginals.shape[2]
    return torch.empty_like(marginals), marginals.new_empty((T, T)), marginals.new_empty(T), marginals.new_empty(T)


@torch.library.register_fake("crfkit::expected_transition_counts")
def _(emissions, transitions, start, end, lengths):
    B, _L, T = emissions.shape
    return emissions.new_empty((B, T, T))


@torch.library.register_fake("crfkit::viterbi")
def _(emissions, transitions, start, end, lengths):
    B, L, _T = emissions.shape
    return emissions.new_empty(B), emissions.new_empty((B, L), dtype=torch.long)


@torch.library.register_fake("crfkit::kbest_viterbi")
def _(emissions, transitions, start, end, lengths, k):
    B, L, _T = emissions.shape
    return emissions.new_empty((B, k)), emissions.new_empty((B, k, L), dtype=torch.long)


@torch.library.register_fake("crfkit::kbest_viterbi_with_log_probs")
def _(emissions, transitions, start, end, lengths, k):
    B, L, _T = emissions.shape
    return emissions.new_empty((B, k)), emissions.new_empty((B, k, L), dtype=torch.long), emissions.new_empty((B, k))


@torch.library.register_fake("crfkit::sequence_score")
def _(emissions, transitions, start, end, lengths, tags):
    return emissions.new_empty(tags.shape[:2])


@torch.library.register_fake("crfkit::sequence_score_backward")
def _(grad_scores, emissions, lengths, tags):
    T = emissions.shape[2]
    return torch.empty_like(emissions), emissions.new_empty((T, T)), emissions.new_empty(T), emissions.new_empty(T)


# ---- autograd ---------------------------------------------------------------------------------
# The formulas of log_partition, viterbi, kbest_viterbi and sequence_score
# are registered in C++ (csrc/autograd.cpp), so that a call does not pass through Python's
# autograd wrapper. The marginals' formula stays here: it picks the analytic kernel
# (marginals_backward) where the device has one, else differentiates the reference.
def _save_crf_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])


def _marginals_backward(ctx, grad_marginals):
    """Gradients of the marginals op's inputs (emissions, transitions, start, end, lengths).

    The derivative of the marginals is a Hessian-vector product of log Z. On the CPU it is the
    analytic kernel marginals_backward (csrc/cpu/marginals_backward.cpp: the tangent of the
    forward-backward in the direction of grad_marginals, one pass, in double). That op has no
    derivative of its own: differentiating its result again (a third derivative of log Z)
    raises. On CUDA, which has no kernel for it, the derivative is taken through the reference
    (autograd over its forward pass, twice), which can be differentiated again.
    """
    emissions, transitions, start, end, lengths = ctx.saved_tensors
    if _has_kernel("marginals_backward", emissions):
        grads = ops.marginals_backward(grad_marginals, emissions, transitions, lengths, start, end)
        return (*grads, None)
    with torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (emissions, transitions, start, end)]
        mu = reference.marginals(inputs[0], inputs[1], lengths, inputs[2], inputs[3])
        grads = torch.autograd.grad(mu, inputs, grad_marginals, allow_unused=True)
    return (*[torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)], None)


torch.library.register_autograd("crfkit::marginals", _marginals_backward, setup_context=_save_crf_inputs)


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
            for name in EXPECTED_SCHEMAS for key in ("CPU", "CUDA")}


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
    return ops.log_partition(emissions, transitions, start, end, lengths)


def expected_transition_counts(emissions, transitions, lengths, start, end) -> Tensor:
    # The kernel has no derivative of its own: differentiable calls take the reference.
    if _needs_grad(emissions, transitions, start, end) or not _has_kernel("expected_transition_counts", emissions):
        if lengths.device.type in VALUES_CHECKED_ON_DEVICE:  # no kernel checks them in this call
            # Imported here, not at the top: crfkit._arguments asks crfkit.backends which backend
            # is current, and this module is imported while crfkit.backends is being set up.
            from .._arguments import check_length_values

            check_length_values(lengths, emissions.shape[1])
        return reference.expected_transition_counts(emissions, transitions, lengths, start, end)
    return ops.expected_transition_counts(emissions, transitions, start, end, lengths)


def marginals(emissions, transitions, lengths, start, end) -> Tensor:
    return ops.marginals(emissions, transitions, start, end, lengths)


def marginals_and_transition_counts(emissions, transitions, lengths, start, end):
    # Both from one forward-backward where a kernel gives both (CPU, no gradient): the exact
    # entropy, cross entropy and KL of crfkit.distribution need both, and each alone costs a
    # whole forward-backward.
    if _needs_grad(emissions, transitions, start, end) or not _has_kernel("log_partition_with_marginals", emissions):
        return (marginals(emissions, transitions, lengths, start, end),
                expected_transition_counts(emissions, transitions, lengths, start, end))
    _, mu, counts = ops.log_partition_with_marginals(emissions, transitions, start, end, lengths)
    return mu, counts


def viterbi(emissions, transitions, lengths, start, end):
    scores, paths = ops.viterbi(emissions, transitions, start, end, lengths)
    return paths, scores


def kbest_viterbi(emissions, transitions, k, lengths, start, end):
    # Without gradient, one op gives the lists and log Z (the CPU runs both kernels side by side
    # when the batch is smaller than the threads); differentiable calls take the two
    # differentiable ops.
    if not _needs_grad(emissions, transitions, start, end) and _has_kernel("kbest_viterbi_with_log_probs", emissions):
        scores, paths, log_probs = ops.kbest_viterbi_with_log_probs(emissions, transitions, start, end, lengths, k)
        return paths, scores, log_probs
    scores, paths = ops.kbest_viterbi(emissions, transitions, start, end, lengths, k)
    log_z = ops.log_partition(emissions, transitions, start, end, lengths)
    return paths, scores, reference.log_probs_from_scores(scores, log_z)


def sequence_score(emissions, transitions, tags, lengths, start, end) -> Tensor:
    return ops.sequence_score(emissions, transitions, start, end, lengths, tags)
