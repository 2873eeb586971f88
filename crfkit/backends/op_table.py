"""The compiled ops, listed once: every other list of them is derived from OPS.

csrc/crfkit.cpp defines the schemas, the one place they are written: the C++ kernels register
against them, the CUDA emulator copies that block (tools/cuda_compile_check/emulator/build.py),
and source_schemas() below reads them from the file. This table holds what the Python side
needs of each op beyond its schema (its fake), and the users of the list derive theirs from it:

- crfkit.backends.compiled checks the loaded extension's schemas against those of the sources
  (an extension built from older sources is refused instead of being called with arguments in
  another order) and registers each op's fake (meta) implementation;
- the CUDA emulator (tools/cuda_compile_check/emulator) registers the same fakes for its own
  namespace, and its compare tool runs every op of example_arguments();
- tests/test_parity.py and tests/test_cuda.py run torch.library.opcheck over example_arguments().

Argument order, the same in every schema and in crfkit.functional: emissions, transitions, then k,
tags or noise where the op has one, then lengths, start, end. Backward ops take the upstream gradient
first and return the gradients of (emissions, transitions, start, end). Decoders return
(scores, paths), values first as torch.topk does.

Shapes: emissions (B, L, T); transitions (T, T) as [from, to], or per example (B, Lt, T, T) with
start, end (B, T) (the CPU kernels: csrc/cpu/per_example.cpp); start, end (T,); lengths (B,)
int64; tags (B, N, L) int64; noise (L, B, n, T) standard Gumbels (sample_with_replacement and
sample_without_replacement; their CUDA kernels take shared (T, T) transitions only).
"""
from __future__ import annotations

import functools
import os
import re
from typing import Callable, Dict, NamedTuple, Optional

import torch
from torch import Tensor


class Op(NamedTuple):
    fake: Callable  # shapes and dtypes of the outputs, from the arguments' (torch.library.register_fake)
    cuda: bool = True  # whether csrc/cuda has a kernel for it (the emulator and tests/test_cuda.py run those)


def _grads_like(emissions: Tensor, transitions=None, start=None, end=None):
    """The gradients of (emissions, transitions, start, end): shaped like them, (T, T), (T,), (T,)
    where they are not given (the ops whose gradients are of shared parameters only)."""
    T = emissions.shape[2]
    if transitions is None:
        return torch.empty_like(emissions), emissions.new_empty((T, T)), emissions.new_empty(T), emissions.new_empty(T)
    return torch.empty_like(emissions), torch.empty_like(transitions), torch.empty_like(start), torch.empty_like(end)


def _counts_like(emissions: Tensor, transitions: Tensor) -> Tensor:
    """Expected transition counts (B, T, T), or per-example transition gradients shaped like
    per-example transitions (B, Lt, T, T) (log_partition_with_marginals)."""
    B, _L, T = emissions.shape
    return torch.empty_like(transitions) if transitions.dim() == 4 else emissions.new_empty((B, T, T))


def _grads_from_counts(marginals: Tensor, counts: Tensor):
    """log_partition_backward_from_marginals: per example where the counts are (B, Lt, T, T)."""
    if counts.dim() != 4:
        return _grads_like(marginals)
    B, _L, T = marginals.shape
    per_sentence = marginals.new_empty((B, T))
    return torch.empty_like(marginals), torch.empty_like(counts), per_sentence, torch.empty_like(per_sentence)


OPS: Dict[str, Op] = {
    "log_partition": Op(
        lambda emissions, transitions, lengths, start, end: emissions.new_empty(emissions.shape[0])),
    "marginals": Op(
        lambda emissions, transitions, lengths, start, end: torch.empty_like(emissions)),
    # The marginals' vector-Jacobian product (their autograd formula); not differentiable.
    "marginals_backward": Op(
        lambda grad_marginals, emissions, transitions, lengths, start, end: _grads_like(emissions)),
    "log_partition_backward": Op(
        lambda grad_log_z, emissions, transitions, lengths, start, end: _grads_like(emissions, transitions, start,
                                                                                    end)),
    # log Z with its gradients for grad_log_z = 1 (a differentiable log Z: crfkit/backends/compiled.py).
    "log_partition_with_marginals": Op(
        lambda emissions, transitions, lengths, start, end: (
            emissions.new_empty(emissions.shape[0]), torch.empty_like(emissions),
            _counts_like(emissions, transitions))),
    "log_partition_backward_from_marginals": Op(
        lambda grad_log_z, marginals, transition_counts, lengths: _grads_from_counts(marginals, transition_counts)),
    "expected_transition_counts": Op(
        lambda emissions, transitions, lengths, start, end: emissions.new_empty(
            (emissions.shape[0], emissions.shape[2], emissions.shape[2]))),
    # The counts' vector-Jacobian product (their autograd formula); not differentiable.
    "expected_transition_counts_backward": Op(
        lambda grad_counts, emissions, transitions, lengths, start, end: _grads_like(emissions)),
    "viterbi": Op(
        lambda emissions, transitions, lengths, start, end: (
            emissions.new_empty(emissions.shape[0]), emissions.new_empty(emissions.shape[:2], dtype=torch.long))),
    "kbest_viterbi": Op(
        lambda emissions, transitions, k, lengths, start, end: (
            emissions.new_empty((emissions.shape[0], k)),
            emissions.new_empty((emissions.shape[0], k, emissions.shape[1]), dtype=torch.long))),
    # kbest_viterbi's outputs and scores - log Z from one call; not differentiable.
    "kbest_viterbi_with_log_probs": Op(
        lambda emissions, transitions, k, lengths, start, end: (
            emissions.new_empty((emissions.shape[0], k)),
            emissions.new_empty((emissions.shape[0], k, emissions.shape[1]), dtype=torch.long),
            emissions.new_empty((emissions.shape[0], k)))),
    "sequence_score": Op(
        lambda emissions, transitions, tags, lengths, start, end: emissions.new_empty(tags.shape[:2])),
    "sequence_score_backward": Op(
        lambda grad_scores, emissions, tags, lengths: _grads_like(emissions)),
    # Paths (B, n, L) drawn with replacement for the Gumbels noise (L, B, n, T); not differentiable
    # (csrc/cpu/sampling.cpp, csrc/cuda/sampling.cu).
    "sample_with_replacement": Op(
        lambda emissions, transitions, noise, lengths, start, end: emissions.new_empty(
            (emissions.shape[0], noise.shape[2], emissions.shape[1]), dtype=torch.long)),
    # Paths (B, n, L) of n distinct sequences (stochastic beam search) for the same noise; not
    # differentiable (csrc/cpu/sampling.cpp, csrc/cuda/sampling.cu).
    "sample_without_replacement": Op(
        lambda emissions, transitions, noise, lengths, start, end: emissions.new_empty(
            (emissions.shape[0], noise.shape[2], emissions.shape[1]), dtype=torch.long)),
}


# m.def("..." "..." ...) in csrc/crfkit.cpp: the adjacent string literals of one schema.
_DEF = re.compile(r'm\.def\(((?:\s*"[^"\\]*")+)\s*\)')
_LITERAL = re.compile(r'"([^"\\]*)"')


def schemas_in(source: str) -> Dict[str, str]:
    """{op name: schema after the name} of the m.def calls in the STABLE_TORCH_LIBRARY block of C++
    `source` (csrc/crfkit.cpp's text), e.g. {"log_partition": "(Tensor emissions, ...) -> Tensor"}."""
    block = source[source.index("STABLE_TORCH_LIBRARY(crfkit, m)"):]
    found = {}
    for match in _DEF.finditer(block):
        text = "".join(_LITERAL.findall(match.group(1)))
        name, arguments = text.split("(", 1)
        found[name] = "(" + arguments
    return found


@functools.lru_cache(maxsize=1)
def source_schemas() -> Optional[Dict[str, str]]:
    """The schemas csrc/crfkit.cpp defines (schemas_in), read from this copy of crfkit's sources
    (the checkout, or crfkit/_sources in a wheel), or None where it has none."""
    from .._build import source_root

    root = source_root()
    path = os.path.join(root, "csrc", "crfkit.cpp") if root else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        return schemas_in(f.read())


def schema(namespace: str, name: str) -> str:
    """The full schema of op `name` in `namespace` as the sources define it, as
    str(torch.ops.<namespace>.<name>.default._schema) prints it."""
    schemas = source_schemas()
    if schemas is None or name not in schemas:
        raise KeyError(f"op {name} is not defined in this copy's csrc/crfkit.cpp")
    return f"{namespace}::{name}{schemas[name]}"


def check_schemas(namespace: str = "crfkit") -> None:
    """Raise ImportError unless every op of OPS is registered in `namespace` with the schema the
    sources define (an extension built from older sources). Without the sources (a copy without
    them), only that each op is registered."""
    ops = getattr(torch.ops, namespace)
    schemas = source_schemas()
    if schemas is not None and set(schemas) != set(OPS):
        raise ImportError(f"csrc/crfkit.cpp defines the ops {sorted(schemas)}, crfkit/backends/op_table.py lists "
                          f"{sorted(OPS)}: the two must name the same ops")
    for name in OPS:
        found = str(getattr(ops, name).default._schema) if hasattr(ops, name) else "missing"
        expected = schema(namespace, name) if schemas is not None else found
        if found == "missing" or found != expected:
            raise ImportError(
                f"crfkit._C is out of date: op {name} has schema {found!r}, expected "
                f"{expected!r}; rebuild it with `pip install --no-build-isolation -e .`")


def register_fakes(namespace: str = "crfkit") -> None:
    """Register every op's fake implementation for `namespace` (torch.compile traces with them)."""
    for name, op in OPS.items():
        torch.library.register_fake(f"{namespace}::{name}")(op.fake)


def has_kernel(namespace: str, name: str, dispatch_key: str) -> bool:
    """Whether op `name` of `namespace` has a kernel for dispatch_key ("CPU", "CUDA")."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{name}", dispatch_key)


def example_arguments(ops, emissions: Tensor, transitions: Tensor, lengths: Tensor, start: Tensor, end: Tensor,
                      *, tags: Tensor, k: int, grad_log_z: Tensor, grad_scores: Tensor,
                      grad_marginals: Tensor) -> Dict[str, tuple]:
    """{op name: arguments} that call every op of OPS once on these CRF arguments (tags (B, N, L),
    grad_log_z (B,), grad_scores (B, N), grad_marginals (B, L, T)); `ops` is the op namespace
    (torch.ops.crfkit or the emulator's), used to make the inputs of
    log_partition_backward_from_marginals. The counts' upstream gradient (B, T, T) is made
    here, like grad_marginals. Score tensors that require grad stay so, for the ops with a
    derivative."""
    crf = (emissions, transitions, lengths, start, end)
    plain = tuple(x.detach() for x in (emissions, transitions)) + (lengths,) + tuple(x.detach() for x in (start, end))
    with torch.no_grad():
        _, marginals, counts = ops.log_partition_with_marginals(*plain)
    B, _, T = grad_marginals.shape
    grad_counts = torch.linspace(-1.0, 2.0, B * T * T, dtype=grad_marginals.dtype,
                                 device=grad_marginals.device).reshape(B, T, T)
    # Standard Gumbels (L, B, 3, T) for the sampling ops, from a generator of their own.
    L = emissions.shape[1]
    uniform = torch.rand((L, B, 3, T), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    noise = (-(-uniform.clamp(min=1e-300).log()).log()).to(emissions.dtype).to(emissions.device)
    arguments = {
        "log_partition": crf,
        "marginals": plain,
        "marginals_backward": (grad_marginals, *plain),
        "log_partition_backward": (grad_log_z, *plain),
        "log_partition_with_marginals": plain,
        "log_partition_backward_from_marginals": (grad_log_z, marginals, counts, lengths),
        "expected_transition_counts": plain,
        "expected_transition_counts_backward": (grad_counts, *plain),
        "viterbi": crf,
        "kbest_viterbi": (emissions, transitions, k, lengths, start, end),
        "kbest_viterbi_with_log_probs": (plain[0], plain[1], k, lengths, plain[3], plain[4]),
        "sequence_score": (emissions, transitions, tags, lengths, start, end),
        "sequence_score_backward": (grad_scores, plain[0], tags, lengths),
        "sample_with_replacement": (plain[0], plain[1], noise, lengths, plain[3], plain[4]),
        "sample_without_replacement": (plain[0], plain[1], noise, lengths, plain[3], plain[4]),
    }
    assert arguments.keys() == OPS.keys(), "example_arguments must call every op of OPS"
    return arguments
