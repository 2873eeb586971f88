"""The compiled (C++ / CUDA) backend: loads crfkit._C and registers, for each op, a fake (meta)
implementation so that torch.compile can trace it, and its autograd formula (below). The ops,
their schemas and fakes are listed once, in crfkit/backends/op_table.py.

The backward of every op is itself a registered op (log_partition_backward_from_marginals on
the CPU and CUDA, log_partition_backward on a device without log_partition_with_marginals,
sequence_score_backward, marginals_backward, expected_transition_counts_backward), as PyTorch
recommends for custom kernels. Importing this module raises ImportError when the extension is
not built; crfkit.backends then falls back.

Why the autograd formulas are Python: crfkit._C is built against torch's stable C ABI (one
binary for every torch from 2.10 on; csrc/tensor.h), which has no autograd API. The cost is host
time per differentiable call (benchmarks/results/NOTES.md); the front end below keeps calls that
record no backward off the Python autograd kernel altogether.
"""
from __future__ import annotations

import contextlib

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
# Each differentiable op gets its formula with torch.library.register_autograd, so that a direct
# call of torch.ops.crfkit.<op> differentiates too. The front end (the backend interface below)
# calls the ops with no autograd kernel in between when a call records no backward
# (_below_autograd), and a differentiable log Z through _LogPartition, which computes its
# gradient in the forward.
_LOG_Z_ONCE = ("crfkit: the gradient of log Z is differentiable once only; for second derivatives use "
               "the reference backend (crfkit.use_backend(\"reference\"))")
_MARGINALS_ONCE = ("crfkit: the gradient of the marginals (marginals_backward) is not differentiable; for "
                   "third derivatives of log Z use the reference backend (crfkit.use_backend(\"reference\"))")
_COUNTS_ONCE = ("crfkit: the gradient of the expected transition counts (expected_transition_counts_backward) "
                "is not differentiable; for third derivatives of log Z use the reference backend "
                "(crfkit.use_backend(\"reference\"))")

_KBEST_LOG_PROBS = ("crfkit: kbest_viterbi_with_log_probs is not differentiable; call it under torch.no_grad(), "
                    "or use kbest_viterbi and log_partition (crfkit.kbest_viterbi does)")

def _below_autograd():
    """A context in which an op call goes straight to the kernels of its tensors' device. Under
    torch.compile none is needed (the traced graph has no autograd kernels in it), and dynamo
    cannot trace this one."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch._C._AutoDispatchBelowAutograd()


class _RaiseWhenDifferentiated(torch.autograd.Function):
    """Passes `values` through; differentiating them raises `message`. Its other inputs (the
    upstream gradient and the score tensors) are its edges, so any derivative that depends on
    the values reaches it: a higher derivative that would otherwise be silently incomplete."""

    @staticmethod
    def forward(ctx, message, values, *edges):
        ctx.message = message
        return tuple(v.view_as(v) for v in values)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def _once_differentiable(message: str, grads, *edges):
    """grads (emissions, transitions, start, end) as they are when the backward is not recorded;
    when it is (create_graph=True), with a node that raises `message` when differentiated."""
    if not torch.is_grad_enabled() or not any(isinstance(e, Tensor) and e.requires_grad for e in edges):
        return grads
    return _RaiseWhenDifferentiated.apply(message, grads, *edges)


def _crf_input_grads(grads, undefined: int):
    """The gradients of an op's inputs from those of (emissions, transitions, start, end): None
    for the `undefined` arguments between them (k or tags, lengths)."""
    return (grads[0], grads[1], *([None] * undefined), grads[2], grads[3])


def _path_score_grads(grad_scores: Tensor, emissions: Tensor, paths: Tensor, lengths: Tensor):
    """Gradient of path scores: ones at the emissions / transitions / start / end each path uses.
    grad_scores (B, N), paths (B, N, L)."""
    with _below_autograd():
        return ops.sequence_score_backward(grad_scores.contiguous(), emissions, paths, lengths)


# log Z. register_autograd's forward is the op itself: its backward runs the forward-backward
# again (log_partition_with_marginals). The front end's differentiable log Z takes _LogPartition,
# which keeps the forward's marginals instead.
def _log_partition_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _log_partition_backward(ctx, grad_log_z):
    emissions, transitions, lengths, start, end = ctx.saved_tensors
    grad_log_z = grad_log_z.contiguous()
    with _below_autograd():
        if _has_kernel("log_partition_with_marginals", emissions):
            # The arithmetic of _LogPartition, moved to the backward: the same gradients, bit for bit.
            _, marginals, counts = ops.log_partition_with_marginals(emissions, transitions, lengths, start, end)
            grads = ops.log_partition_backward_from_marginals(grad_log_z, marginals, counts, lengths)
        else:
            grads = ops.log_partition_backward(grad_log_z, emissions, transitions, lengths, start, end)
    return _crf_input_grads(_once_differentiable(_LOG_Z_ONCE, grads, grad_log_z, emissions, transitions, start, end), 1)


class _LogPartition(torch.autograd.Function):
    """A differentiable log Z (B,) where the device has log_partition_with_marginals (CPU and
    CUDA): its gradients for an upstream gradient of 1 are computed in the forward, while the
    forward rows are in cache, and the backward only scales them (it is linear in the upstream
    gradient). The cost: a differentiable log Z never differentiated does the backward's work too;
    evaluate under torch.no_grad()."""

    @staticmethod
    def forward(ctx, emissions, transitions, lengths, start, end):
        with _below_autograd():
            log_z, marginals, counts = ops.log_partition_with_marginals(emissions, transitions, lengths, start, end)
        # The score tensors serve as the edges of _once_differentiable's node (and, like any saved
        # input, make an in-place change of them before the backward an error).
        ctx.save_for_backward(emissions, transitions, lengths, start, end, marginals, counts)
        return log_z

    @staticmethod
    def backward(ctx, grad_log_z):
        emissions, transitions, lengths, start, end, marginals, counts = ctx.saved_tensors
        with _below_autograd():
            grads = ops.log_partition_backward_from_marginals(grad_log_z.contiguous(), marginals, counts, lengths)
        grads = _once_differentiable(_LOG_Z_ONCE, grads, grad_log_z, emissions, transitions, start, end)
        return _crf_input_grads(grads, 1)


# Decoders: the scores are differentiable (sums of the scores the paths use); paths are not.
def _decode_setup(ctx, inputs, output):
    emissions, transitions, *_, lengths, start, end = inputs
    ctx.save_for_backward(emissions, transitions, lengths, start, end, output[1])
    ctx.mark_non_differentiable(output[1])


def _paths_input_grads(grad_scores: Tensor, saved, undefined: int):
    """The input gradients (_crf_input_grads) of path scores, from the saved (emissions,
    transitions, lengths, start, end, paths): paths (B, L) with grad_scores (B,) (Viterbi), or
    (B, N, L) with (B, N). The kernel gives the gradients of shared parameters; per-example ones
    (transitions (B, Lt, T, T)) come from autograd through the reference's sequence_score."""
    emissions, transitions, lengths, start, end, paths = saved
    if paths.dim() == 2:
        grad_scores, paths = grad_scores.unsqueeze(1), paths.unsqueeze(1)
    if transitions.dim() == 4:
        return _crf_input_grads(_per_example_path_score_grads(grad_scores, emissions, transitions, paths, lengths),
                                undefined)
    return _crf_input_grads(_path_score_grads(grad_scores, emissions, paths, lengths), undefined)


def _per_example_path_score_grads(grad_scores: Tensor, emissions: Tensor, transitions: Tensor, paths: Tensor,
                                  lengths: Tensor):
    """_path_score_grads for per-example transitions (B, Lt, T, T) and start / end (B, T), which
    sequence_score_backward's kernel does not take: grad_scores (B, N) added, by scatter_add, at
    the scores each path (B, N, L) uses. Plain tensor ops, so torch.compile traces them."""
    B, N, L = paths.shape
    T = emissions.shape[2]
    real = (torch.arange(L, device=paths.device) < lengths.unsqueeze(1)).unsqueeze(1)  # (B, 1, L)
    weight = (grad_scores.unsqueeze(2) * real).to(emissions.dtype)  # (B, N, L), 0 at padding
    tags = paths.clamp(min=0)
    grad_emissions = emissions.new_zeros(B, L, T).scatter_add_(2, tags.transpose(1, 2), weight.transpose(1, 2))
    nonempty = weight[:, :, 0] if L else grad_scores.new_zeros(B, N)
    grad_start = emissions.new_zeros(B, T)
    grad_end = emissions.new_zeros(B, T)
    grad_transitions = emissions.new_zeros(B, transitions.shape[1], T * T)
    if L:
        last = tags.gather(2, (lengths - 1).clamp(min=0).view(B, 1, 1).expand(B, N, 1)).squeeze(2)
        grad_start.scatter_add_(1, tags[:, :, 0], nonempty)
        grad_end.scatter_add_(1, last, nonempty)
    if L > 1:
        pairs = tags[:, :, :-1] * T + tags[:, :, 1:]  # (B, N, L - 1): the transition into positions 1 ..
        if transitions.shape[1] > 1:  # per position: into (B, L, T * T) at positions 1 .. L - 1
            grad_transitions[:, 1:].scatter_add_(2, pairs.transpose(1, 2), weight[:, :, 1:].transpose(1, 2))
        else:
            grad_transitions[:, 0].scatter_add_(1, pairs.flatten(1), weight[:, :, 1:].flatten(1))
    return grad_emissions, grad_transitions.view(transitions.shape), grad_start, grad_end


def _viterbi_backward(ctx, grad_scores, _grad_paths):
    return _paths_input_grads(grad_scores, ctx.saved_tensors, 1)


def _kbest_viterbi_backward(ctx, grad_scores, _grad_paths):
    return _paths_input_grads(grad_scores, ctx.saved_tensors, 2)


def _sequence_score_setup(ctx, inputs, output):
    emissions, transitions, tags, lengths, start, end = inputs
    ctx.save_for_backward(emissions, transitions, lengths, start, end, tags)


def _sequence_score_backward(ctx, grad_scores):
    return _paths_input_grads(grad_scores, ctx.saved_tensors, 2)  # tags (B, N, L)


class _Decode(torch.autograd.Function):
    """viterbi (k None: scores (B,), paths (B, L)) or kbest_viterbi (scores (B, k), paths (B, k, L))
    with differentiable scores, for the front end: an autograd.Function costs less host time per
    call than the register_autograd kernel that a direct op call goes through (its pytree walk and
    argument refilling), and does the same."""

    @staticmethod
    def forward(ctx, k, emissions, transitions, lengths, start, end):
        with _below_autograd():
            if k is None:
                scores, paths = ops.viterbi(emissions, transitions, lengths, start, end)
            else:
                scores, paths = ops.kbest_viterbi(emissions, transitions, k, lengths, start, end)
        ctx.k = k
        ctx.save_for_backward(emissions, transitions, lengths, start, end, paths)
        ctx.mark_non_differentiable(paths)
        return scores, paths

    @staticmethod
    def backward(ctx, grad_scores, _grad_paths):
        return (None, *_paths_input_grads(grad_scores, ctx.saved_tensors, 1))  # None: k


class _SequenceScore(torch.autograd.Function):
    """sequence_score (B, N) with its gradient, for the front end (as _Decode)."""

    @staticmethod
    def forward(ctx, emissions, transitions, tags, lengths, start, end):
        with _below_autograd():
            scores = ops.sequence_score(emissions, transitions, tags, lengths, start, end)
        ctx.save_for_backward(emissions, transitions, lengths, start, end, tags)
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        return _paths_input_grads(grad_scores, ctx.saved_tensors, 2)  # tags (B, N, L)


def _not_differentiable(message: str):
    """The autograd formula of an op with no derivative: differentiating its outputs raises."""
    def backward(ctx, *grads):
        raise RuntimeError(message)
    return backward


def _refuse_to_record(message: str):
    """A setup_context that raises: the op cannot be called where it would record a derivative."""
    def setup_context(ctx, inputs, output):
        raise RuntimeError(message)
    return setup_context


def _save_crf_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])


def _second_derivative(kernel_name: str, reference_op, message: str):
    """The autograd formula of an op that is a first derivative of log Z (the marginals, in the
    emissions; the expected transition counts, in the transitions): its vector-Jacobian product
    is a Hessian-vector product of log Z. Where the device has the analytic kernel kernel_name
    (csrc/cpu/marginals_backward.cpp, csrc/cuda/marginals_backward.cu: the tangent of the
    forward-backward in the direction of the upstream gradient, one pass, in double) it is that
    kernel, whose result cannot be differentiated again (a third derivative of log Z raises
    `message`); elsewhere autograd over the reference's op (reference.gradients_by_autograd)."""
    def backward(ctx, grad):
        emissions, transitions, lengths, start, end = ctx.saved_tensors
        if _has_kernel(kernel_name, emissions) and transitions.dim() == 2:  # (no kernel for per-example ones)
            with _below_autograd():
                g = getattr(ops, kernel_name)(grad, emissions, transitions, lengths, start, end)
            g = _once_differentiable(message, g, grad, emissions, transitions, start, end)
            return g[0], g[1], None, g[2], g[3]
        return reference.gradients_by_autograd(reference_op, ctx.saved_tensors, grad)
    return backward


def _register_autograd():
    register = torch.library.register_autograd
    register("crfkit::log_partition", _log_partition_backward, setup_context=_log_partition_setup)
    register("crfkit::viterbi", _viterbi_backward, setup_context=_decode_setup)
    register("crfkit::kbest_viterbi", _kbest_viterbi_backward, setup_context=_decode_setup)
    register("crfkit::sequence_score", _sequence_score_backward, setup_context=_sequence_score_setup)
    register("crfkit::marginals", _second_derivative("marginals_backward", reference.marginals, _MARGINALS_ONCE),
             setup_context=_save_crf_inputs)
    register("crfkit::expected_transition_counts",
             _second_derivative("expected_transition_counts_backward", reference.expected_transition_counts,
                                _COUNTS_ONCE), setup_context=_save_crf_inputs)
    nothing = lambda ctx, inputs, output: None  # noqa: E731
    for name, message in (("marginals_backward", _MARGINALS_ONCE),
                          ("expected_transition_counts_backward", _COUNTS_ONCE)):
        register(f"crfkit::{name}", _not_differentiable(message), setup_context=nothing)
    # A call that would record a derivative raises at once (setup_context runs only then), instead
    # of returning outputs that carry none.
    register("crfkit::kbest_viterbi_with_log_probs", _not_differentiable(_KBEST_LOG_PROBS),
             setup_context=_refuse_to_record(_KBEST_LOG_PROBS))


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
# Per-example transitions (B, Lt, T, T): the CPU kernels (csrc/cpu/per_example.cpp) and, where
# built, the CUDA ones (csrc/cuda/per_example.cu); elsewhere the reference runs them
# (crfkit.backends.for_transitions).
PER_EXAMPLE_DEVICES: tuple = ("cpu", "cuda") if _KERNELS[("log_partition", "CUDA")] else ("cpu",)


def _has_kernel(op_name: str, tensor: Tensor) -> bool:
    """Whether op_name has a kernel for tensor's device."""
    return _KERNELS[(op_name, "CUDA" if tensor.is_cuda else "CPU")]


def _call(op, differentiable: bool, *args):
    """op(*args): through its autograd formula when the call records a backward (or is being
    traced by torch.compile, which takes the formula from the op), else straight to the device's
    kernel: a call that records nothing does not pass through Python's autograd kernel."""
    if differentiable or torch.compiler.is_compiling():
        return op(*args)
    with _below_autograd():
        return op(*args)


def log_partition(emissions: Tensor, transitions: Tensor, lengths: Tensor, start: Tensor, end: Tensor) -> Tensor:
    # Without gradient: O(T) working memory per thread. A differentiable call where the device has
    # log_partition_with_marginals also computes the gradients for its backward (_LogPartition).
    if _needs_grad(emissions, transitions, start, end) and _has_kernel("log_partition_with_marginals", emissions):
        return _LogPartition.apply(emissions, transitions, lengths, start, end)
    return _call(ops.log_partition, False, emissions, transitions, lengths, start, end)


def expected_transition_counts(emissions, transitions, lengths, start, end) -> Tensor:
    if not _has_kernel("expected_transition_counts", emissions):
        if lengths.device.type in VALUES_CHECKED_ON_DEVICE:  # no kernel checks them in this call
            # Imported here, not at the top: crfkit._arguments asks crfkit.backends which backend
            # is current, and this module is imported while crfkit.backends is being set up.
            from .._arguments import check_length_values

            check_length_values(lengths, emissions.shape[1])
        return reference.expected_transition_counts(emissions, transitions, lengths, start, end)
    return _call(ops.expected_transition_counts, _needs_grad(emissions, transitions, start, end),
                 emissions, transitions, lengths, start, end)


def marginals(emissions, transitions, lengths, start, end) -> Tensor:
    return _call(ops.marginals, _needs_grad(emissions, transitions, start, end), emissions, transitions, lengths,
                 start, end)


def marginals_and_transition_counts(emissions, transitions, lengths, start, end):
    # Both from one forward-backward where a kernel gives both (CPU, no gradient): the exact
    # entropy, cross entropy and KL of crfkit.distribution need both, and each alone costs a
    # whole forward-backward.
    if _needs_grad(emissions, transitions, start, end) or not _has_kernel("log_partition_with_marginals", emissions):
        return (marginals(emissions, transitions, lengths, start, end),
                expected_transition_counts(emissions, transitions, lengths, start, end))
    _, mu, counts = _call(ops.log_partition_with_marginals, False, emissions, transitions, lengths, start, end)
    return mu, counts


def viterbi(emissions, transitions, lengths, start, end):
    if _needs_grad(emissions, transitions, start, end):
        return _Decode.apply(None, emissions, transitions, lengths, start, end)
    return _call(ops.viterbi, False, emissions, transitions, lengths, start, end)


def kbest_viterbi(emissions, transitions, k, lengths, start, end):
    # Without gradient, one op gives the lists and log Z (the CPU runs both kernels side by side
    # when the batch is smaller than the threads); differentiable calls take the two
    # differentiable ops.
    differentiable = _needs_grad(emissions, transitions, start, end)
    if not differentiable and _has_kernel("kbest_viterbi_with_log_probs", emissions):
        return _call(ops.kbest_viterbi_with_log_probs, False, emissions, transitions, k, lengths, start, end)
    if differentiable:
        scores, paths = _Decode.apply(k, emissions, transitions, lengths, start, end)
    else:
        scores, paths = _call(ops.kbest_viterbi, False, emissions, transitions, k, lengths, start, end)
    log_z = log_partition(emissions, transitions, lengths, start, end)
    return scores, paths, reference.log_probs_from_scores(scores, log_z)


def sequence_score(emissions, transitions, tags, lengths, start, end) -> Tensor:
    if _needs_grad(emissions, transitions, start, end):
        return _SequenceScore.apply(emissions, transitions, tags, lengths, start, end)
    return _call(ops.sequence_score, False, emissions, transitions, tags, lengths, start, end)


def _sample(op_name: str, fallback, emissions, transitions, n, lengths, start, end, generator) -> Tensor:
    """Both samplers: the device's kernel (csrc/cpu/sampling.cpp, csrc/cuda/sampling.cu; both
    take per-example transitions too), else the PyTorch path, `fallback`. The
    kernel takes the standard Gumbels of every position at once, (L, B, n, T), drawn here in the
    order in which the PyTorch path draws its (B, n, T) block per position
    (reference.gumbel_noise), so on the CPU a generator seeded alike gives both the same samples;
    without replacement the kernel conditions those blocks on the parents' values itself, as the
    PyTorch path does. No autograd formula: the paths are integers, and the front end's
    log-probabilities (sequence_score - log_partition) are differentiable through those ops."""
    if not _has_kernel(op_name, emissions):
        if lengths.device.type in VALUES_CHECKED_ON_DEVICE:  # no kernel checks them in this call
            from .._arguments import check_length_values  # (imported here: see expected_transition_counts)

            check_length_values(lengths, emissions.shape[1])
        return fallback(emissions, transitions, n, lengths, start, end, generator)
    B, L, T = emissions.shape
    with torch.no_grad():
        noise = reference.gumbel_noise((L, B, n, T), emissions, generator)
    return _call(getattr(ops, op_name), False, emissions, transitions, noise, lengths, start, end)


def sample_with_replacement(emissions, transitions, n, lengths, start, end, generator=None) -> Tensor:
    return _sample("sample_with_replacement", reference.sample_with_replacement, emissions, transitions, n,
                   lengths, start, end, generator)


def sample_without_replacement(emissions, transitions, n, lengths, start, end, generator=None) -> Tensor:
    # stochastic beam search in the kernel
    return _sample("sample_without_replacement", reference.sample_without_replacement, emissions, transitions, n,
                   lengths, start, end, generator)


_register_autograd()
